"""Scale: pools of many nodes, a node of many chunks, Redis at many keys, soaks, and the hot paths eviction and lookups pay."""
