"""Training objectives behind one seam (`objective.Objective`): SFT, DPO, ORPO, KTO and GRPO."""
