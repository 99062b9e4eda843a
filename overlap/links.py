"""The link classes between two ranks, fastest first: ``shm`` (CPU ranks of one node, through shared memory),
``nvlink`` (GPUs of one node over NVLink/NVSwitch), ``pcie`` (GPUs of one node without NVLink), ``network``
(ranks of two nodes).

The facts layer's, so that what names them without torch (plans, the log's plan text, the command line) reads them
here; which link each pair of ranks has is `overlap.world`'s.
"""

LINK_CLASSES = ("shm", "nvlink", "pcie", "network")
