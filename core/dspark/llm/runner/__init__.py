"""The model runner: checkpoint config and loading, the Llama forward over a paged KV cache, its kernels."""
