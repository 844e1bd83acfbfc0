"""The harness across hosts: network namespaces on a bridge as hosts, with real links between them."""
