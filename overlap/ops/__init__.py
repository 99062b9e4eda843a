"""The fused operations, one module each (see each module's docstring).

Import the functions from `overlap` (``overlap.all_gather_matmul``); ``overlap.ops.<name>`` is
the module that implements one.
"""
