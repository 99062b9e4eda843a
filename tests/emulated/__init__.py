"""The emulated two-node cluster (`python -m bench.emulated_cluster`): its decisions and figures."""
