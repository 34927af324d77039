"""The prefix cache's memory: the radix tree, the KV pool, the state pool of hybrid models, the page table,
the manager, the host tier and cache files."""
