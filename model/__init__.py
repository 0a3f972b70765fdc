"""The native engine. Importing the package sets XLA:CPU's vector width before any backend starts, and
keeps JAX's probes for absent platforms (TPU on a CPU or GPU machine) out of the log."""

from model.cpu_tuning import prefer_wide_vectors, quiet_platform_probes

prefer_wide_vectors()
quiet_platform_probes()
