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
                  poslsh.partitions, poslsh.partitions_nd, poslsh.decoding, poslsh.modules]


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
    """num_samples everywhere."""
    bad = [w for w, fn, _ in ALL if w.split(".")[1] in ("cost", "theory") or w.count(".") == 1
           for p in params(fn) if p == "s"]
    assert not bad, bad


def test_one_word_for_the_rate():
    """No public function takes both slopes and sigma: each family has one word, and converting is the
    caller's (poslsh.alibi_sigmas, 1 / slopes)."""
    both = [where for where, fn, _ in ALL if {"slopes", "sigma"} <= set(params(fn))]
    assert not both, both
    seen = {where for where, fn, _ in ALL if set(params(fn)) & {"slopes", "sigma"}}
    assert {"poslsh.alibi_attention", "poslsh.theory.smallest_window", "poslsh.sample_partitions"} <= seen


OPS_BIASES_MODULES = (poslsh.alibi_attention, poslsh.windowed_alibi_attention, poslsh.alibi.alibi_bias,
                      poslsh.window.make_window, poslsh.reference.alibi_attention_reference,
                      poslsh.reference.alibi_attention_reference_nd, poslsh.reference.alibi_bias_nd,
                      poslsh.AlibiAttention.__init__, poslsh.PoslshAttention.__init__, poslsh.decoding.certified_window)
SAMPLERS_COST_THEORY = (poslsh.sample_partitions, poslsh.sample_partitions_nd, poslsh.PartitionSchedule.__init__,
                        poslsh.cost.poslsh_keys_per_query, poslsh.cost.expected_reach, poslsh.cost.cost_matched_window,
                        poslsh.window.windows_in_sigmas, poslsh.alibi.alibi_matrix, poslsh.reference.alibi_matrix_nd,
                        poslsh.reference.kernel_attention_nd, poslsh.decoding.cache_bound_whp)


def test_the_word_of_each_family():
    """Ops, biases, modules and integrations take slopes; samplers, cost and theory take sigma."""
    for fn in OPS_BIASES_MODULES:
        assert "slopes" in params(fn) and "sigma" not in params(fn), fn
    for fn in SAMPLERS_COST_THEORY:
        assert "sigma" in params(fn) and "slopes" not in params(fn), fn
    theory = [getattr(poslsh.theory, n) for n in poslsh.theory.__all__ if callable(getattr(poslsh.theory, n))]
    assert not [fn for fn in theory if "slopes" in params(fn)]
    assert sum("sigma" in params(fn) for fn in theory) >= 10
    from poslsh.integrations import hf
    assert "sigma" not in params(hf.patch_alibi)


def test_window_none_is_no_cut_everywhere():
    """window=None means one thing wherever it appears: no cut, exact ALiBi (docs/window.md)."""
    for fn in (poslsh.alibi_attention, poslsh.windowed_alibi_attention, poslsh.window.make_window,
               poslsh.reference.alibi_attention_reference, poslsh.AlibiAttention.__init__):
        assert params(fn)["window"].default is None, fn
    assert poslsh.window.make_window(poslsh.alibi_slopes(2)).window.tolist() == [poslsh.window.NO_WINDOW] * 2
    assert poslsh.AlibiAttention(num_heads=2, window=None).exact


def test_no_shims_left():
    """0.3.0 keeps no old spelling of 0.2 (CHANGELOG.md lists each and what to write instead)."""
    import importlib
    for gone in ("poslsh._compat", "poslsh.window_theory", "poslsh.attention_nd", "poslsh.window.cost"):
        with pytest.raises(ImportError):
            importlib.import_module(gone)
    for module, name in [(poslsh, "alibi_bias"), (poslsh, "make_window"), (poslsh, "poslsh_attention_2d"),
                         (poslsh.alibi, "AlibiWindow"), (poslsh.cost, "window_error_bound"),
                         (poslsh.theory, "alibi_window"), (poslsh.decoding, "op_of"),
                         (poslsh.PartitionsND, "fixed_boxes"), (poslsh.window, "windowed_alibi_attention")]:
        assert not hasattr(module, name), (module, name)
    with pytest.raises(ValueError, match="op must be one of"):
        poslsh.available_backends(op="grid")


def test_one_sampler_keyword_and_grid_keyword_only():
    for fn in (poslsh.sample_partitions, poslsh.sample_partitions_nd, poslsh.PartitionSchedule.__init__,
               poslsh.PoslshAttention.__init__):
        assert "sampler" in params(fn) and "method" not in params(fn), fn
    for fn in (poslsh.poslsh_attention_nd, poslsh.reference.alibi_attention_reference_nd,
               poslsh.reference.kernel_attention_nd,
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


def test_one_spelling_for_the_nd_family():
    names = set(dir(poslsh)) | set(dir(poslsh.PartitionsND)) | set(dir(poslsh.reference))
    assert not [n for n in names if n.endswith("_2d") or "box" in n.lower() and not n.startswith("_")]
    assert poslsh.PartitionsND.op == "nd" and "nd" in poslsh.ops.registry.OPS


def test_the_public_face_is_small_and_the_readme_writes_no_inverse():
    assert len(poslsh.__all__) <= 24 and all(hasattr(poslsh, n) for n in poslsh.__all__)
    readme = (REPO / "README.md").read_text()
    assert not re.search(r"1\s*/\s*sigma", readme), "the README names slopes and sigma, never 1 / sigma"
