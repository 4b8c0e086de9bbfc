"""`kconvert inspect`: what a checkpoint (`checkpoint`) or a converted directory (`converted`) holds, from configs and
headers only."""
