module stasis.local/tests/testbins

go 1.26
