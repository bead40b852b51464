"""Models: loading Hugging Face models (``hf``), low-precision and quantized weights (``precision``), the chunked
loss head (``loss_head``) and running a task's model (``forward``: its loss, checkpointing, offloading)."""
