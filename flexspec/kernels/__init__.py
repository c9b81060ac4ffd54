"""Where torch starts: tensor values, the lowering to FlexAttention, the dense float64 reference
and block masks from interval analysis. The lowering and the reference never import each other."""
