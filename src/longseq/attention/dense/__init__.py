"""Dense attention: every allowed key, O(L^2) (``full``)."""
