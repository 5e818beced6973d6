"""The agent: one per node. Joins rendezvous, runs and watches the node's workers."""
