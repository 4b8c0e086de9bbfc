"""kconvert's inference engine over converted checkpoints, a package per role.

    config.py, model.py, pipeline.py   hyper-parameters; the nn.Module tree loaded unit by unit; a forward across stages
    layers/      what every family builds from: linear weights in their stored formats, slots, rotary embeddings
    cache/       decode caches and their byte formats (MLA latent pages, DeepSeek-V4's compressed cache, the host tier)
    models/      one package per model family's blocks, and `registry`: the one place a family's layer kinds are chosen
    runtime/     generation, ranks launched from one command, time-to-ready, tp checks
    calibrate/   calibrated INT4 (GPTQ) layer by layer through the engine
    chat/        `python -m engine.chat`
"""
