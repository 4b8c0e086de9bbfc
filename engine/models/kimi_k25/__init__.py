"""Kimi-K2.5's own modules over DeepSeek text: its MoonViT vision tower and projector (`vision`)."""
