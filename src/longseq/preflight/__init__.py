"""The checks a command passes before anything is written: one home for them.

A refused command prints one line, ``error: <key>: <message>`` (or ``error: <file>: ...``), exits 1 and leaves no
run directory. ``train.py`` and ``eval.py`` compose the command once before Hydra makes the run directory and check
it there (``command``); ``runner.train`` / ``runner.evaluate`` check what in-process callers and multirun jobs give
them. What only the run itself can find out (a data split too small for the batch, a corrupt file) refuses from
inside the run, which then removes the run directory it made if nothing was trained (``runner``).

- ``command``: ``preflight_train`` (train.py, resume included) and ``check_composition`` (eval.py);
- ``compose``: the composed config, Hydra's composition failures named by key, ``check_before_run``;
- ``train``: ``check_train_config``, the list a train config passes (values, model, Lightning, data files);
- ``evaluate``: ``check_eval_config`` (checkpoint, mode, split, sampling knobs, data files);
- ``trainer``: the ``trainer.*`` keys and Lightning's own checks (a Trainer built with the run's callbacks);
- ``resume``: what a resume may change (``FIXED_ON_RESUME``) and what it changes.

Imports point down only: this package uses ``data``, ``tasks`` and ``utils``; ``runner`` and the entry points use it.
"""
