"""`python -m engine.chat`: arguments, the session loop, streaming text, chat on a source checkpoint (the tokenizer,
template and images it reads come from engine/inputs/)."""
