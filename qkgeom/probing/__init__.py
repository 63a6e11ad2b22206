"""Probing: q, k and the attention pattern -> tidy geometry rows. Pure maths (geometry), hook sites
(hooks), the one accumulator (probe), the supported Hugging Face architectures (archs, hf), TensorBoard
scalars (scalars) and qkgeom.Probe for any training loop (tracking). Imports only the ground floor."""
