"""`kconvert export`: a source re-written in a serving engine's own layout. `job` (ExportJob and the run), `formats`
(each format as a registry scheme under an engine's names and packing, its quantization_config), `table` (the
formats' one list)."""
