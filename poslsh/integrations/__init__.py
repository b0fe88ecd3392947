"""Integrations with other libraries (imported lazily: each needs its own extras)."""
from __future__ import annotations

# The oldest transformers the Hugging Face integration runs on. Checked by installing releases
# beside the library and running its integration tests and the docs' blocks: 5.24 renamed the
# models' `past_key_values` argument to `cache`, which the integration passes (its generate()
# hook included); 5.5-5.23 ignore it and decode against no cache, 5.0 has another mask API.
MIN_TRANSFORMERS = "5.24.0"


def require_transformers() -> None:
    """Import transformers, or fail in one line saying what to install (missing, or too old)."""
    try:
        import transformers
        from packaging.version import Version     # a dependency of transformers
    except ModuleNotFoundError:
        raise ModuleNotFoundError(f'poslsh.integrations.hf needs transformers: pip install "transformers>='
                                  f'{MIN_TRANSFORMERS}" safetensors (the [hf] extra of poslsh)') from None
    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise ImportError(f"poslsh.integrations.hf needs transformers >= {MIN_TRANSFORMERS}, found "
                          f"{transformers.__version__}: pip install -U \"transformers>={MIN_TRANSFORMERS}\"")
