"""Training: the demo target LM and EAGLE-3 draft heads (training-time test), with their evaluation.

Everything here runs on the CPU (and on a GPU when asked); nothing is downloaded. The entry points
are ``python -m tandem.training.lm`` (a target LM on the Python standard library),
``python -m drafter.train`` (an EAGLE-3 head for any target) and ``python -m tandem.training.sweep``.
"""
