"""Kimi Linear / Kimi K3 blocks: KDA (Kimi Delta Attention), the SiTU activation and block Attention Residuals."""
