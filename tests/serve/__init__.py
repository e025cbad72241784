"""Tests of ``ortpa serve`` (a package, so its conftest and helpers never shadow the suite-wide ``conftest``)."""
