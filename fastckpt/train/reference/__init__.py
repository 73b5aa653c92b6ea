"""The reference trainer: small, exact state machines used in examples, tests and the self-check.

Not a training framework. ``TinyLM`` (a tied-embedding language model in
numpy), the optimizers (``SGD``, ``Adam``, ``AdamW``), the schedulers
(``StepLR``, ``CosineWarmupLR``, ``ReduceLROnPlateau``), the ``GradScaler``
and the ``ShuffledTokenBatches`` iterator exist to show, and to prove, that a
training run restored from a checkpoint continues bit for bit: each has a
``state_dict()`` / ``load_state_dict()`` that round-trips exactly. Import them
from :mod:`fastckpt.train`; ``python -m fastckpt.train.reference.selfcheck
OUT_DIR`` runs the round-trip check.

>>> from fastckpt.train.reference.model import TinyLM
>>> TinyLM(vocab=8, dim=4, hidden=8).tied
True
"""
