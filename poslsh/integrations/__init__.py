"""Integrations with other libraries (imported lazily: each needs its own extras)."""
from __future__ import annotations

import warnings

# The range of transformers the Hugging Face integration is tested on: the floor and the first release
# past the newest tested one (the [hf] extra says the same; `make test` runs the newest release in the range,
# `make test-hf-range` the floor). Below the floor the integration refuses to import (5.24 renamed the
# models' `past_key_values` argument to `cache`, which the integration passes; 5.5-5.23 ignore it and
# decode against no cache, 5.0 has another mask API); past the range `patch_alibi` warns in one line.
MIN_TRANSFORMERS = "5.24.0"
BELOW_TRANSFORMERS = "5.26"


class UntestedTransformersWarning(UserWarning):
    """The installed transformers is newer than the integration's tested range."""


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


def warn_if_untested(what: str) -> None:
    """One :class:`UntestedTransformersWarning` line when the installed transformers is past the tested range
    (``what`` patches that release's model internals)."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) >= Version(BELOW_TRANSFORMERS):
        warnings.warn(f"{what} is tested with transformers >={MIN_TRANSFORMERS},<{BELOW_TRANSFORMERS}, found "
                      f"{transformers.__version__}: check its results, or pip install "
                      f"\"transformers<{BELOW_TRANSFORMERS}\"", UntestedTransformersWarning, stacklevel=3)
