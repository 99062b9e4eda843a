"""The MoE ops and layer on CPU ranks: strategies, the token bound, grouped GEMMs, hierarchical groups, expert
migration, the steady state."""
