"""The native engine. Importing the package sets XLA:CPU's vector width before any backend starts."""

from model.cpu_tuning import prefer_wide_vectors

prefer_wide_vectors()
