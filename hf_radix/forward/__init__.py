"""The forward: the model runner, CUDA graphs, the forward context, host staging and fused ops."""
