"""``overlap demo``: train a small GPT-style model twice on the local ranks, with torch's tensor-parallel
styles and with overlap's, from the same seed and data, and compare losses, step time and memory.

* `overlap.demo.data`: the fixed synthetic token stream (a seeded Markov chain).
* `overlap.demo.model`: the model (embedding, attention and MLP blocks, an MoE block) and its two
  parallelizations.
* `overlap.demo.train`: the training loop on the ranks (`train_rank`), both runs side by side.
* `overlap.demo.report`: the printed report and the ``--plot`` figure.

Only the command line (`overlap.cli.demo`) imports this package.
"""
