"""Checkpoint families: `qkgeom pretrained`'s settings (config), revisions of one model (revisions),
our runs as Hugging Face folders (export), a study's runs read as families (study)."""
