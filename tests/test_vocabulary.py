"""One vocabulary (docs/architecture.md, "Vocabulary"): the same words in the same order everywhere,
read off the signatures of the public functions."""
import inspect
import re
from pathlib import Path

import pytest

import poslsh
import poslsh.decoding
import poslsh.partitions_nd
import poslsh.reference

REPO = Path(__file__).resolve().parents[1]
PUBLIC_MODULES = [poslsh, poslsh.cost, poslsh.theory, poslsh.window, poslsh.reference, poslsh.alibi,
                  poslsh.partitions, poslsh.partitions_nd, poslsh.decoding]


def public_callables(module):
    for name in getattr(module, "__all__", []):
        obj = getattr(module, name)
        if inspect.isclass(obj):
            yield f"{module.__name__}.{name}", obj.__init__, obj
            for meth, fn in vars(obj).items():
                if not meth.startswith("_") and callable(fn) or isinstance(fn, classmethod):
                    fn = fn.__func__ if isinstance(fn, classmethod) else fn
                    if callable(fn) and not meth.startswith("_"):
                        yield f"{module.__name__}.{name}.{meth}", fn, fn
        elif callable(obj):
            yield f"{module.__name__}.{name}", obj, obj


ALL = sorted({(where, fn, marker) for m in PUBLIC_MODULES for where, fn, marker in public_callables(m)},
             key=lambda t: t[0])


def params(fn):
    try:
        return inspect.signature(fn).parameters      # follows functools.wraps to the real signature
    except (TypeError, ValueError):
        return {}


def test_no_parameter_named_s():
    """num_samples everywhere (the old keyword s= still works for one release, with a warning)."""
    bad = [w for w, fn, _ in ALL if w.split(".")[1] in ("cost", "theory") or w.count(".") == 1
           for p in params(fn) if p == "s"]
    assert not bad, bad


# Not the per-head rate of a call: a width law's own scale (the protocol a custom law implements) and
# the raw fields of the positional objects (what they record; their checked constructors take both:
# make_window, sample_partitions, sample_partitions_nd).
NOT_A_RATE = ("poslsh.GammaWidths.", "poslsh.FixedWidth.", "poslsh.AlibiWindow", "poslsh.window.AlibiWindow",
              "poslsh.Partitions", "poslsh.partitions.Partitions", "poslsh.PartitionsND.from_tensors",
              "poslsh.partitions_nd.PartitionsND.from_tensors")


def test_every_rate_takes_the_other_word():
    """A public function of the per-head rate takes slopes and sigma, exactly one of them."""
    missing = []
    for where, fn, marker in ALL:
        if where.startswith(NOT_A_RATE):
            continue
        names = set(params(fn))
        if names & {"slopes", "sigma"} and not {"slopes", "sigma"} <= names \
                and getattr(fn, "rate_words", None) is None and getattr(marker, "rate_words", None) is None:
            missing.append(where)
    assert not missing, missing


def test_the_word_of_each_family():
    """Ops, biases and modules lead with slopes; samplers, cost and theory with sigma."""
    for fn in (poslsh.windowed_alibi_attention, poslsh.alibi_attention, poslsh.alibi.alibi_bias,
               poslsh.window.make_window, poslsh.reference.alibi_attention_nd, poslsh.reference.alibi_bias_nd):
        assert list(params(fn))[:5].count("slopes") == 1 and "sigma" in params(fn), fn
    for fn in (poslsh.sample_partitions, poslsh.sample_partitions_nd, poslsh.cost.poslsh_keys_per_query,
               poslsh.window.cost_matched_window, poslsh.theory.psi, poslsh.theory.spectral_expectation_bound):
        assert "sigma" in params(fn) and "slopes" not in list(params(fn))[:1], fn


def test_one_sampler_keyword_and_grid_keyword_only():
    for fn in (poslsh.sample_partitions, poslsh.sample_partitions_nd, poslsh.PartitionSchedule.__init__,
               poslsh.PoslshAttention.__init__):
        assert "sampler" in params(fn) and "method" not in params(fn), fn
    for fn in (poslsh.poslsh_attention_nd, poslsh.reference.alibi_attention_nd, poslsh.reference.kernel_attention_nd,
               poslsh.reference.poslsh_attention_reference_nd, poslsh.PoslshAttention.attend, poslsh.attend):
        assert params(fn)["grid"].kind is inspect.Parameter.KEYWORD_ONLY, fn


ORDER = ["n", "d", "num_samples", "sigma", "delta", "C"]


@pytest.mark.parametrize("name", poslsh.theory.__all__)
def test_one_argument_order_in_theory(name):
    """What the bound is about first, then n, d, num_samples, sigma, delta, C (in that order, among the
    parameters that can be given by position; keyword-only ones have no order)."""
    fn = getattr(poslsh.theory, name)
    if inspect.isclass(fn):
        return
    seen = [p for p, v in params(fn).items() if p in ORDER and v.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert seen == sorted(seen, key=ORDER.index), (name, seen)


OLD_NAMES = {"box_bounds", "max_box_size", "fixed_boxes"}       # shims for one release (tests/test_compat.py)


def test_one_spelling_for_the_nd_family():
    names = set(dir(poslsh)) | set(dir(poslsh.PartitionsND)) | set(dir(poslsh.reference))
    assert not [n for n in names - OLD_NAMES if n.endswith("_2d") or "box" in n.lower() and not n.startswith("_")]
    assert poslsh.PartitionsND.op == "nd" and "nd" in poslsh.ops.registry.OPS


def test_the_public_face_is_small_and_the_readme_writes_no_inverse():
    assert len(poslsh.__all__) <= 24 and all(hasattr(poslsh, n) for n in poslsh.__all__)
    readme = (REPO / "README.md").read_text()
    assert not re.search(r"1\s*/\s*sigma", readme), "the README names slopes and sigma, never 1 / sigma"
