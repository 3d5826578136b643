"""Model integrations: `transformers` (the "mok" experts backend) and `megatron` (the MoK functional ABI,
the Megatron bridge and the MoKMegakernel backend). Optional dependencies are imported only where used."""
