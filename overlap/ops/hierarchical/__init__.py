"""Groups that span nodes, for every op family: what the ``hierarchical`` strategy
(`overlap.ops.tp.hierarchical_gather`, `overlap.ops.tp.hierarchical_reduce`, `overlap.ops.tp.hierarchical_weight`,
`overlap.ops.moe.hierarchical`) and expert migration (`overlap.ops.moe.migration`) share, and how every
strategy's ranks agree across nodes.

* `nodes`: the group's nodes (`Layout`: which ranks share a node, each rank's counterparts), the node's process
  group and symmetric heap, the store record of a rank that died in a call;
* `agreement`: the agreement of a call across nodes without a collective, through the nodes' pads and the headers
  and trailers between counterparts (every strategy's handshake there, called by `overlap.ops.context`);
* `node_call`: the ``hierarchical`` strategy's call on its node's heap: the slot header, waits on the node's flags,
  the network sends and receives, and the failure rules (read its docstring first).

Importing this package imports none of them (`node_call` imports `overlap.ops.context`, which imports `agreement`).
"""
