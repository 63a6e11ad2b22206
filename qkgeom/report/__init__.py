"""Reports: DataFrame -> Figure (plots), a study's or run's HTML report (study), a model's or family's
report (family). Draws what the analysis computed; computes no statistic of its own."""
