"""`python -m engine.chat`: arguments, tokenizer and template, images, streaming text, chat on a source."""
