package ddp

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// TestDevicePlacementErrors: device buffers without Options.Device, host slices with it,
// Options.Device on a group without device memory, and a device Grad over its Data fail
// New with clear errors. (The device path itself is tested over the nccl backend on the
// fakes: reducer/device_test.go and examples/gpumlp.)
func TestDevicePlacementErrors(t *testing.T) {
	c := pgtest.NewCluster(1)
	defer c.Close()
	pg := c.Group(0)
	dev := procgroup.DeviceBuffer{Ptr: 0x1000, Type: procgroup.Float32, Count: 4}
	devGrad := procgroup.DeviceBuffer{Ptr: 0x2000, Type: procgroup.Float32, Count: 4}
	for _, tc := range []struct {
		name   string
		params []Param
		opts   Options
		want   string
	}{
		{"device data without Device", []Param{{Name: "w", Data: dev, Grad: devGrad}}, Options{}, "needs Options.Device"},
		{"host data with Device", []Param{{Name: "w", Data: make([]float32, 4), Grad: make([]float32, 4)}}, Options{Device: true}, "must be a procgroup.DeviceBuffer"},
		{"host grad with Device", []Param{{Name: "w", Data: dev, Grad: make([]float32, 4)}}, Options{Device: true}, "Grad is []float32"},
		{"host group", []Param{{Name: "w", Data: dev, Grad: devGrad}}, Options{Device: true}, "procgroup.Device"},
		{"device Grad on its Data", []Param{{Name: "w", Data: dev, Grad: procgroup.DeviceBuffer{Ptr: dev.Ptr + 8, Type: procgroup.Float32, Count: 4}}}, Options{Device: true}, "its Data and Grad share memory"},
	} {
		_, err := New(context.Background(), pg, tc.params, tc.opts)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error saying %q", tc.name, err, tc.want)
		}
		if err != nil && tc.name != "host group" && !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("%s: %v does not wrap ErrInvalidArgument", tc.name, err)
		}
	}
}
