"""Building blocks every family shares: linear weights in their stored formats, empty slots, rotary embeddings."""
