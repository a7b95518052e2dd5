module stasis.local/cluster/supervisor

go 1.26
