"""What a study and a benchmark tell: the confirmed decision, its verdict and JSON export; plots; the side-by-side
benchmark; projections of a speedup onto other devices' cost profiles."""
