// Package k8s holds Kubernetes manifests for goddp's trainer; its tests check that every
// document decodes strictly into Kubernetes' API types (k8s.io/api), and that the variables
// each kind of job gives its pods are what procgroup.EnvFrom understands.
package k8s

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/goddp/goddp/procgroup"
)

// The parts of the manifests the test reads.
type container struct {
	Name  string `yaml:"name"`
	Image string `yaml:"image"`
	Ports []struct {
		Name          string `yaml:"name"`
		ContainerPort int    `yaml:"containerPort"`
	} `yaml:"ports"`
	Env []struct {
		Name      string `yaml:"name"`
		Value     string `yaml:"value"`
		ValueFrom *struct {
			SecretKeyRef *struct {
				Name string `yaml:"name"`
				Key  string `yaml:"key"`
			} `yaml:"secretKeyRef"`
		} `yaml:"valueFrom"`
	} `yaml:"env"`
}

type podTemplate struct {
	Metadata struct {
		Labels map[string]string `yaml:"labels"`
	} `yaml:"metadata"`
	Spec struct {
		Subdomain  string      `yaml:"subdomain"`
		Containers []container `yaml:"containers"`
	} `yaml:"spec"`
}

type object struct {
	APIVersion string `yaml:"apiVersion"`
	Kind       string `yaml:"kind"`
	Metadata   struct {
		Name string `yaml:"name"`
	} `yaml:"metadata"`
	Spec struct {
		// Service
		ClusterIP string            `yaml:"clusterIP"`
		Selector  map[string]string `yaml:"selector"`
		Ports     []struct {
			Port int `yaml:"port"`
		} `yaml:"ports"`
		// Job
		CompletionMode string      `yaml:"completionMode"`
		Completions    int         `yaml:"completions"`
		Parallelism    int         `yaml:"parallelism"`
		Template       podTemplate `yaml:"template"`
		// PyTorchJob
		ReplicaSpecs map[string]struct {
			Replicas int         `yaml:"replicas"`
			Template podTemplate `yaml:"template"`
		} `yaml:"pytorchReplicaSpecs"`
	} `yaml:"spec"`
}

// load decodes every document of a manifest into the structs above, which hold only what the
// environment check needs (the decoder is lenient; TestManifestsSchema is the strict check
// against Kubernetes' own types).
func load(t *testing.T, path string) map[string]object {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	objs := map[string]object{}
	dec := yaml.NewDecoder(bytes.NewReader(b))
	for {
		var o object
		if err := dec.Decode(&o); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		objs[o.Kind] = o
	}
	return objs
}

// podEnv is a container's environment as the pod sees it, plus what Kubernetes or the
// operator adds; a Secret's value reads as "secret:<name>/<key>".
func podEnv(t *testing.T, c container, added map[string]string) map[string]string {
	t.Helper()
	env := map[string]string{}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil:
			env[e.Name] = "secret:" + e.ValueFrom.SecretKeyRef.Name + "/" + e.ValueFrom.SecretKeyRef.Key
		case e.ValueFrom != nil:
			t.Fatalf("env %s: unsupported valueFrom", e.Name)
		default:
			env[e.Name] = e.Value
		}
	}
	for k, v := range added {
		if _, dup := env[k]; dup {
			t.Fatalf("the manifest sets %s, which the launcher sets", k)
		}
		env[k] = v
	}
	return env
}

func lookupIn(m map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
}

type pod struct {
	name string
	env  map[string]string
	want procgroup.Env
}

// pytorchJobPods are the pods the Kubeflow training operator makes of a PyTorchJob, with
// the variables it sets: MASTER_ADDR <name>-master-0, MASTER_PORT the Master's port named
// pytorchjob-port (default 23456), WORLD_SIZE the number of replicas, RANK 0 for the Master
// and 1.. for the Workers (and PYTHONUNBUFFERED).
func pytorchJobPods(t *testing.T, o object) []pod {
	master, ok := o.Spec.ReplicaSpecs["Master"]
	if !ok || master.Replicas != 1 {
		t.Fatalf("PyTorchJob: want one Master replica, have %+v", o.Spec.ReplicaSpecs)
	}
	worker := o.Spec.ReplicaSpecs["Worker"]
	port := 23456
	mc := findContainer(t, master.Template, "pytorch")
	for _, p := range mc.Ports {
		if p.Name == "pytorchjob-port" {
			port = p.ContainerPort
		}
	}
	world := master.Replicas + worker.Replicas
	addr := o.Metadata.Name + "-master-0"
	var pods []pod
	for rank := 0; rank < world; rank++ {
		tmpl, name := master.Template, "master-0"
		if rank > 0 {
			tmpl, name = worker.Template, fmt.Sprintf("worker-%d", rank-1)
		}
		env := podEnv(t, findContainer(t, tmpl, "pytorch"), map[string]string{
			"MASTER_ADDR": addr, "MASTER_PORT": strconv.Itoa(port), "WORLD_SIZE": strconv.Itoa(world),
			"RANK": strconv.Itoa(rank), "PYTHONUNBUFFERED": "1",
		})
		pods = append(pods, pod{name: name, env: env, want: procgroup.Env{
			Rank: rank, WorldSize: world, LocalWorldSize: 1, GroupRank: rank, MasterAddr: addr, MasterPort: port,
			Token: "secret:goddp-token/token", Source: "torchrun",
		}})
	}
	return pods
}

// indexedJobPods are an Indexed Job's pods: Kubernetes sets JOB_COMPLETION_INDEX, names
// the pod <job>-<index>, and with spec.subdomain and a headless Service of that name the
// pod is reachable as <job>-<index>.<service>.
func indexedJobPods(t *testing.T, job, svc object) []pod {
	if job.Spec.CompletionMode != "Indexed" || job.Spec.Completions < 1 || job.Spec.Parallelism != job.Spec.Completions {
		t.Fatalf("Job: want completionMode Indexed with parallelism = completions, have %+v", job.Spec)
	}
	tmpl := job.Spec.Template
	if tmpl.Spec.Subdomain != svc.Metadata.Name || svc.Spec.ClusterIP != "None" {
		t.Fatalf("the Job's subdomain %q must name a headless Service (have %q, clusterIP %q)",
			tmpl.Spec.Subdomain, svc.Metadata.Name, svc.Spec.ClusterIP)
	}
	for k, v := range svc.Spec.Selector {
		if tmpl.Metadata.Labels[k] != v {
			t.Fatalf("the Service selects %s=%s, which the Job's pods lack (%v)", k, v, tmpl.Metadata.Labels)
		}
	}
	c := findContainer(t, tmpl, "trainer")
	master := fmt.Sprintf("%s-0.%s", job.Metadata.Name, svc.Metadata.Name)
	var pods []pod
	for i := 0; i < job.Spec.Completions; i++ {
		env := podEnv(t, c, map[string]string{"JOB_COMPLETION_INDEX": strconv.Itoa(i)})
		port, _ := strconv.Atoi(env["MASTER_PORT"])
		if len(svc.Spec.Ports) == 0 || svc.Spec.Ports[0].Port != port || len(c.Ports) == 0 || c.Ports[0].ContainerPort != port {
			t.Fatalf("MASTER_PORT %d is not the Service's and the container's port", port)
		}
		pods = append(pods, pod{name: fmt.Sprintf("%s-%d", job.Metadata.Name, i), env: env, want: procgroup.Env{
			Rank: i, WorldSize: job.Spec.Completions, LocalWorldSize: 1, GroupRank: i, MasterAddr: master, MasterPort: port,
			Token: "secret:goddp-token/token", Source: "indexed-job",
		}})
	}
	return pods
}

func findContainer(t *testing.T, tmpl podTemplate, name string) container {
	t.Helper()
	for _, c := range tmpl.Spec.Containers {
		if c.Name == name {
			if c.Image == "" {
				t.Fatalf("container %s has no image", name)
			}
			return c
		}
	}
	t.Fatalf("no container named %q", name)
	return container{}
}

// TestManifestsEnv: every pod of each manifest, with the variables its launcher adds, is
// the rank it should be, in a world of the right size, with the right master.
func TestManifestsEnv(t *testing.T) {
	pj := load(t, "pytorchjob.yaml")
	ij := load(t, "indexed-job.yaml")
	if pj["PyTorchJob"].APIVersion != "kubeflow.org/v1" || ij["Job"].APIVersion != "batch/v1" || ij["Service"].APIVersion != "v1" {
		t.Fatalf("unexpected kinds or API versions: %v %v", pj, ij)
	}
	for _, c := range []struct {
		manifest string
		pods     []pod
	}{
		{"pytorchjob.yaml", pytorchJobPods(t, pj["PyTorchJob"])},
		{"indexed-job.yaml", indexedJobPods(t, ij["Job"], ij["Service"])},
	} {
		ranks := map[int]bool{}
		for _, p := range c.pods {
			t.Run(c.manifest+"/"+p.name, func(t *testing.T) {
				got, err := procgroup.EnvFrom(lookupIn(p.env))
				if err != nil {
					t.Fatalf("env %v: %v", p.env, err)
				}
				if got != p.want {
					t.Fatalf("EnvFrom =\n %+v\nwant\n %+v", got, p.want)
				}
				ranks[got.Rank] = true
			})
		}
		if len(ranks) != len(c.pods) {
			t.Errorf("%s: %d pods hold %d distinct ranks", c.manifest, len(c.pods), len(ranks))
		}
	}
}
