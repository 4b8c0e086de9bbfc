"""Running a model: generation, pipeline-parallel ranks launched from one command, time-to-ready, tp checks."""
