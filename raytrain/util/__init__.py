"""Small pieces every side uses, each the one way raytrain does its thing: ``imports``
(a spec's ``package.module:Name`` to an object), ``provenance`` (the checkout's commit),
``redaction`` (secrets out of whatever is written or printed), ``terminal`` (control
characters out of what is printed), ``precision`` (``trainer.precision: auto`` and the
cost of emulated bf16). None imports Ray, torch or Lightning at module level, nor any
raytrain package but ``spec`` and ``errors``."""
