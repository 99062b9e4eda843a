"""Benchmarks of the fused ops: one definition of the cases (`cases`: the tensor-parallel ops at
``m x k x n`` or a real model's layer, `models`: the Llama-3 presets; the MoE layer at ``T,H,F,E,K``
with presets of real models' proportions; what a case is: `definitions`), what each op's benchmark
computes (`case_data`), one runner (`runner`: each case checked by `checks`, then timed by
`timing`), and its outputs: the table and JSON (`report`), a progress bar (`progress`),
``--compare`` (`compare`) and ``--plot`` (`plot`, matplotlib).

``overlap bench`` runs them on locally started ranks (or in place under torchrun); the
pytest-benchmark wrappers in the top-level ``bench/`` run the same cases on a standing pool of
ranks (`session`), and the other ``bench/`` scripts reuse them too. What the command line needs before
any rank starts (op, mode and strategy names, shape parsers) is `names`, which does not import torch;
this package's names are imported on first use.
"""

from .. import lazy as _lazy

#: public name -> the submodule defining it, imported on first use (PEP 562): the command line's parser
#: imports `names` and `models` without loading torch through `cases`
_LAZY = {
    **dict.fromkeys(("BENCH_OPS", "DEFAULT_OPS", "MODES", "MOE_OPS", "MOE_PRESETS", "SP_OPS", "MoEShape",
                     "parse_moe_shape", "parse_shape"), "names"),
    **dict.fromkeys(("OPS", "SUITES", "Case", "MoECase", "SpCase", "default_cases", "preset_cases", "sp_preset_cases",
                     "suite_cases"), "cases"),
    **dict.fromkeys(("SP_PRESETS", "TP_PRESETS", "DenseModel", "sp_problems", "tp_problems"), "models"),
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = _lazy.exports(__name__, _LAZY, globals())
