"""The prefix cache's memory: the radix tree, the KV pool and page table, the manager,
host tier and cache files."""
