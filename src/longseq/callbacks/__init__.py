"""Lightning callbacks, one per module, referenced by full path from ``conf/callbacks/*.yaml``."""
