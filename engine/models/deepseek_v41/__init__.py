"""DeepSeek-V4.1 (block kind "v41"): V4's attention with compression by role and its cache (built on V4's), Engram,
single-pass mHC, the router's image bias, its DSpark stage (`dspark`), its ViT and aligner (`vision`) and image
preprocessing (`image`)."""
