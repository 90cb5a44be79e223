"""Analysis of finished runs, shared by the library and the studies: collecting runs, paired comparisons,
the nested bootstrap, the figures and the one table of policy colours and labels."""
