"""The converted directory's on-disk format (docs/FORMAT.md), the contract between converter, loader and any engine:
`catalog` (kconvert.json: validate, digest, read, update), `rank_tensors` (each rank's tensor list), `ranks`,
`units`, `journal` (resume records), `integrity` (sizes, CRC-32s, headers against rows)."""
