"""Kimi Linear / Kimi K3: KDA (Kimi Delta Attention) and its recurrent state cache, gated NoPE MLA, the SiTU
activation, the latent MoE, block Attention Residuals, and Kimi K3's MoonViT-V2 vision tower (`vision`)."""
