// Package testbins holds the small static programs of the cluster's test images.
package testbins
