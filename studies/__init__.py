"""The studies, one folder each: presets (experiment/), sweep script, report code and a README naming its
reading and results (docs/studies.md is the index). studies/sweeps.sh is their one sweep loop."""
