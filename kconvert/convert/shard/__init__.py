"""`kconvert shard`, the pipeline from a source to a converted directory: `job` (ShardJob and the run), `plan` (what
each rank's files hold: made a validation bucket at a time from `outputs`' parts), `pipeline` (work items placed on
pipeline stages), `unit` (one unit's files, read and written in one pass), `stacks` (a unit's like weights N at a
time), `catalog` (kconvert.json and the rank lists, written last)."""
