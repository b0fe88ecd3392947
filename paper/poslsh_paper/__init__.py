"""The paper's reproduction on the ``poslsh`` library: jobs (``experiments``), measurements on real
models (``analysis``), offline corpora and images (``data``), SmolLM2 (``models``) and the ``poslsh``
command (``cli``). The library never imports this package."""
__version__ = "0.3.0"
