package procgroup

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func lookupIn(m map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) {
		v, ok := m[k]
		return v, ok
	}
}

func TestEnvFrom(t *testing.T) {
	torch := map[string]string{
		"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
		"GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400",
	}
	with := func(base map[string]string, kv ...string) map[string]string {
		m := map[string]string{}
		for k, v := range base {
			m[k] = v
		}
		for i := 0; i < len(kv); i += 2 {
			if kv[i+1] == "<unset>" {
				delete(m, kv[i])
			} else {
				m[kv[i]] = kv[i+1]
			}
		}
		return m
	}
	slurm := map[string]string{
		"SLURM_PROCID": "3", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
		"SLURM_TASKS_PER_NODE": "2(x3)", "SLURM_JOB_NODELIST": "gpu[007-009]", "SLURM_JOB_ID": "123456",
		"SLURM_LAUNCH_NODE_IPADDR": "10.1.1.1",
	}
	ompi := map[string]string{
		"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
		"OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_NODE_RANK": "0",
	}
	cases := []struct {
		name    string
		env     map[string]string
		want    Env
		wantErr string // substring; "" means success
	}{
		{name: "torchrun", env: torch, want: Env{Rank: 5, WorldSize: 8, LocalRank: 1, LocalWorldSize: 4,
			GroupRank: 1, MasterAddr: "10.0.0.1", MasterPort: 29400, Source: "torchrun"}},
		{name: "torchrun minimal (Kubernetes style)", env: map[string]string{"RANK": "2", "WORLD_SIZE": "3",
			"MASTER_ADDR": "master-0", "MASTER_PORT": "23456"},
			want: Env{Rank: 2, WorldSize: 3, LocalRank: 0, LocalWorldSize: 1, GroupRank: 2,
				MasterAddr: "master-0", MasterPort: 23456, Source: "torchrun"}},
		{name: "torchrun with launcher store and token", env: with(torch, "MASTER_ADDR", "<unset>", "MASTER_PORT", "<unset>",
			"GODDP_STORE_ADDR", "127.0.0.1:5000", "GODDP_TOKEN", " tok "),
			want: Env{Rank: 5, WorldSize: 8, LocalRank: 1, LocalWorldSize: 4, GroupRank: 1,
				StoreAddr: "127.0.0.1:5000", StoreKind: StoreGRPC, Token: "tok", Source: "torchrun"}},
		{name: "nothing set: a single process", env: map[string]string{"HOME": "/root", "SLURM_JOB_ID": "7"},
			want: Env{WorldSize: 1, LocalWorldSize: 1, Source: "single", StoreKind: StoreMemory}},
		{name: "only MASTER_ADDR", env: map[string]string{"MASTER_ADDR": "h"}, wantErr: "MASTER_ADDR is set but RANK and WORLD_SIZE are not"},
		{name: "only LOCAL_RANK", env: map[string]string{"LOCAL_RANK": "0"}, wantErr: "LOCAL_RANK is set but RANK and WORLD_SIZE are not"},
		{name: "only GODDP_STORE", env: map[string]string{"GODDP_STORE": "tcpstore://h:1"}, wantErr: "GODDP_STORE is set but RANK"},
		// srun's variables, with a compressed node list: the master is its first host.
		{name: "srun", env: map[string]string{"SLURM_PROCID": "5", "SLURM_NTASKS": "10", "SLURM_LOCALID": "1",
			"SLURM_NODEID": "2", "SLURM_NODELIST": "node[01-04,07]", "SLURM_TASKS_PER_NODE": "2(x5)",
			"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NNODES": "5"},
			want: Env{Rank: 5, WorldSize: 10, LocalRank: 1, LocalWorldSize: 2, GroupRank: 2,
				MasterAddr: "node01", MasterPort: 24242, Source: "slurm"}},
		// torchrun 1.13, static rendezvous (its default): exactly what the agent sets.
		{name: "torchrun agent store", env: map[string]string{"LOCAL_RANK": "1", "RANK": "1", "GROUP_RANK": "0",
			"ROLE_RANK": "1", "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1",
			"ROLE_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "1",
			"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "True",
			"NCCL_ASYNC_ERROR_HANDLING": "1", "TORCHELASTIC_ERROR_FILE": "/tmp/x/error.json"},
			want: Env{Rank: 1, WorldSize: 2, LocalRank: 1, LocalWorldSize: 2, MasterAddr: "127.0.0.1", MasterPort: 29500,
				StoreAddr: "127.0.0.1:29500", StoreKind: StoreTCPStore, StorePrefix: "goddp/none/1", Source: "torchrun"}},
		{name: "torchrun c10d rendezvous: rank 0 hosts", env: with(torch, "TORCHELASTIC_USE_AGENT_STORE", "False", "TORCHELASTIC_RUN_ID", "j"),
			want: Env{Rank: 5, WorldSize: 8, LocalRank: 1, LocalWorldSize: 4, GroupRank: 1, MasterAddr: "10.0.0.1", MasterPort: 29400, Source: "torchrun"}},
		{name: "GODDP_STORE tcpstore", env: with(torch, "GODDP_STORE", "tcpstore://store:29511"),
			want: Env{Rank: 5, WorldSize: 8, LocalRank: 1, LocalWorldSize: 4, GroupRank: 1, MasterAddr: "10.0.0.1", MasterPort: 29400,
				StoreAddr: "store:29511", StoreKind: StoreTCPStore, Source: "torchrun"}},
		{name: "GODDP_STORE grpc", env: with(torch, "GODDP_STORE", "grpc://127.0.0.1:5000"),
			want: Env{Rank: 5, WorldSize: 8, LocalRank: 1, LocalWorldSize: 4, GroupRank: 1, MasterAddr: "10.0.0.1", MasterPort: 29400,
				StoreAddr: "127.0.0.1:5000", StoreKind: StoreGRPC, Source: "torchrun"}},
		{name: "GODDP_STORE unknown scheme", env: with(torch, "GODDP_STORE", "etcd://h:1"), wantErr: `unknown scheme "etcd"`},
		{name: "GODDP_STORE no port", env: with(torch, "GODDP_STORE", "tcpstore://h"), wantErr: "want tcpstore://host:port"},
		{name: "GODDP_STORE no scheme", env: with(torch, "GODDP_STORE", "h:1"), wantErr: "want tcpstore://host:port or grpc://host:port"},
		{name: "GODDP_STORE and GODDP_STORE_ADDR", env: with(torch, "GODDP_STORE", "grpc://h:1", "GODDP_STORE_ADDR", "h:1"), wantErr: "both GODDP_STORE and GODDP_STORE_ADDR"},
		{name: "agent store without MASTER_PORT", env: with(torch, "TORCHELASTIC_USE_AGENT_STORE", "True", "MASTER_PORT", "<unset>"), wantErr: "TORCHELASTIC_USE_AGENT_STORE=True but"},
		{name: "bad restart count", env: with(torch, "TORCHELASTIC_USE_AGENT_STORE", "True", "TORCHELASTIC_RESTART_COUNT", "x"), wantErr: "TORCHELASTIC_RESTART_COUNT"},
		// A Kubernetes Indexed Job: the manifest sets WORLD_SIZE and the master; the index is the rank.
		{name: "indexed job", env: map[string]string{"JOB_COMPLETION_INDEX": "2", "WORLD_SIZE": "4",
			"MASTER_ADDR": "train-0.train", "MASTER_PORT": "29500"},
			want: Env{Rank: 2, WorldSize: 4, LocalWorldSize: 1, GroupRank: 2, MasterAddr: "train-0.train", MasterPort: 29500, Source: "indexed-job"}},
		{name: "indexed job without WORLD_SIZE", env: map[string]string{"JOB_COMPLETION_INDEX": "2", "MASTER_ADDR": "m", "MASTER_PORT": "1"},
			wantErr: "WORLD_SIZE not set"},
		{name: "indexed job index too large", env: map[string]string{"JOB_COMPLETION_INDEX": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "m", "MASTER_PORT": "1"},
			wantErr: "JOB_COMPLETION_INDEX=4 outside [0, WORLD_SIZE=4)"},
		{name: "RANK wins over JOB_COMPLETION_INDEX", env: map[string]string{"JOB_COMPLETION_INDEX": "3", "RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "m", "MASTER_PORT": "1"},
			want: Env{Rank: 1, WorldSize: 4, LocalWorldSize: 1, GroupRank: 1, MasterAddr: "m", MasterPort: 1, Source: "torchrun"}},
		{name: "missing WORLD_SIZE", env: with(torch, "WORLD_SIZE", "<unset>"), wantErr: "WORLD_SIZE not set"},
		{name: "missing RANK", env: with(torch, "RANK", "<unset>"), wantErr: "RANK not set"},
		{name: "blank RANK", env: with(torch, "RANK", "  "), wantErr: "RANK not set"},
		{name: "non-numeric RANK", env: with(torch, "RANK", "one"), wantErr: `RANK="one" is not an integer`},
		{name: "non-numeric MASTER_PORT", env: with(torch, "MASTER_PORT", "http"), wantErr: `MASTER_PORT="http"`},
		{name: "rank >= world", env: with(torch, "RANK", "8"), wantErr: "RANK=8 outside [0, WORLD_SIZE=8)"},
		{name: "negative rank", env: with(torch, "RANK", "-1"), wantErr: "RANK=-1"},
		{name: "zero world", env: with(torch, "WORLD_SIZE", "0", "RANK", "0"), wantErr: "WORLD_SIZE=0"},
		{name: "local rank >= local world", env: with(torch, "LOCAL_RANK", "4"), wantErr: "LOCAL_RANK=4 outside"},
		{name: "local world > world", env: with(torch, "LOCAL_WORLD_SIZE", "9"), wantErr: "LOCAL_WORLD_SIZE=9 outside"},
		{name: "LOCAL_RANK without LOCAL_WORLD_SIZE", env: with(torch, "LOCAL_WORLD_SIZE", "<unset>"), wantErr: "LOCAL_WORLD_SIZE not set"},
		{name: "group rank out of range", env: with(torch, "GROUP_RANK", "8"), wantErr: "GROUP_RANK=8"},
		{name: "no MASTER_ADDR", env: with(torch, "MASTER_ADDR", "<unset>"), wantErr: "MASTER_ADDR not set"},
		{name: "no MASTER_PORT", env: with(torch, "MASTER_PORT", "<unset>"), wantErr: "MASTER_PORT=0"},
		{name: "port too large", env: with(torch, "MASTER_PORT", "70000"), wantErr: "MASTER_PORT=70000"},
		{name: "bad GODDP_STORE_ADDR", env: with(torch, "GODDP_STORE_ADDR", "nohostport"), wantErr: "GODDP_STORE_ADDR"},
		{name: "both token variables", env: with(torch, "GODDP_TOKEN", "a", "GODDP_TOKEN_FILE", "/x"), wantErr: "both GODDP_TOKEN and GODDP_TOKEN_FILE"},
		{name: "missing token file", env: with(torch, "GODDP_TOKEN_FILE", "/nonexistent/token"), wantErr: "GODDP_TOKEN_FILE"},

		{name: "slurm", env: slurm, want: Env{Rank: 3, WorldSize: 6, LocalRank: 1, LocalWorldSize: 2, GroupRank: 1,
			MasterAddr: "gpu007", MasterPort: 20000 + 123456%20000, Source: "slurm"}},
		{name: "slurm with MASTER_ADDR/PORT", env: with(slurm, "MASTER_ADDR", "head", "MASTER_PORT", "1234"),
			want: Env{Rank: 3, WorldSize: 6, LocalRank: 1, LocalWorldSize: 2, GroupRank: 1,
				MasterAddr: "head", MasterPort: 1234, Source: "slurm"}},
		{name: "slurm NTASKS_PER_NODE and launch node", env: with(slurm, "SLURM_NTASKS_PER_NODE", "3",
			"SLURM_JOB_NODELIST", "<unset>", "SLURM_JOB_ID", "<unset>"),
			want: Env{Rank: 3, WorldSize: 6, LocalRank: 1, LocalWorldSize: 3, GroupRank: 1,
				MasterAddr: "10.1.1.1", MasterPort: DefaultMasterPort, Source: "slurm"}},
		{name: "slurm uneven tasks per node", env: with(slurm, "SLURM_TASKS_PER_NODE", "3,2(x2)", "SLURM_NODEID", "2",
			"SLURM_PROCID", "5", "SLURM_LOCALID", "1", "SLURM_NTASKS", "7"),
			want: Env{Rank: 5, WorldSize: 7, LocalRank: 1, LocalWorldSize: 2, GroupRank: 2,
				MasterAddr: "gpu007", MasterPort: 20000 + 123456%20000, Source: "slurm"}},
		{name: "slurm NPROCS", env: with(slurm, "SLURM_NTASKS", "<unset>", "SLURM_NPROCS", "6"),
			want: Env{Rank: 3, WorldSize: 6, LocalRank: 1, LocalWorldSize: 2, GroupRank: 1,
				MasterAddr: "gpu007", MasterPort: 20000 + 123456%20000, Source: "slurm"}},
		{name: "slurm malformed tasks per node", env: with(slurm, "SLURM_TASKS_PER_NODE", "2(x"), wantErr: "SLURM_TASKS_PER_NODE"},
		{name: "slurm node beyond tasks list", env: with(slurm, "SLURM_NODEID", "5"), wantErr: "SLURM_TASKS_PER_NODE"},
		{name: "slurm no tasks per node", env: with(slurm, "SLURM_TASKS_PER_NODE", "<unset>"), wantErr: "SLURM_NTASKS_PER_NODE"},
		{name: "slurm missing LOCALID", env: with(slurm, "SLURM_LOCALID", "<unset>"), wantErr: "SLURM_LOCALID not set"},
		{name: "slurm procid >= ntasks", env: with(slurm, "SLURM_PROCID", "6"), wantErr: "SLURM_PROCID=6 outside [0, SLURM_NTASKS=6)"},

		{name: "openmpi one host", env: ompi, want: Env{Rank: 2, WorldSize: 4, LocalRank: 2, LocalWorldSize: 4,
			MasterAddr: "127.0.0.1", MasterPort: DefaultMasterPort, Source: "openmpi"}},
		// Exactly what mpirun (Open MPI 4.1) sets for rank 1 of 2 on one host: NODE_RANK is
		// the rank on the node, and the job id gives the port.
		{name: "openmpi as mpirun sets it", env: map[string]string{"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
			"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1",
			"OMPI_MCA_ess_base_jobid": "1628241921", "OMPI_UNIVERSE_SIZE": "2", "PMIX_RANK": "1", "PMIX_NAMESPACE": "1628241921"},
			want: Env{Rank: 1, WorldSize: 2, LocalRank: 1, LocalWorldSize: 2, MasterAddr: "127.0.0.1",
				MasterPort: 20000 + 1628241921%20000, Source: "openmpi"}},
		{name: "openmpi several hosts need MASTER_ADDR", env: with(ompi, "OMPI_COMM_WORLD_LOCAL_SIZE", "2",
			"OMPI_COMM_WORLD_LOCAL_RANK", "0", "OMPI_COMM_WORLD_NODE_RANK", "1"), wantErr: "MASTER_ADDR not set"},
		{name: "openmpi bad size", env: with(ompi, "OMPI_COMM_WORLD_SIZE", "4x"), wantErr: "OMPI_COMM_WORLD_SIZE"},
		{name: "openmpi local rank out of range", env: with(ompi, "OMPI_COMM_WORLD_LOCAL_RANK", "4"), wantErr: "OMPI_COMM_WORLD_LOCAL_RANK=4"},
		{name: "torchrun wins over slurm", env: with(slurm, "RANK", "0", "WORLD_SIZE", "1", "MASTER_ADDR", "h", "MASTER_PORT", "1"),
			want: Env{Rank: 0, WorldSize: 1, LocalWorldSize: 1, MasterAddr: "h", MasterPort: 1, Source: "torchrun"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := EnvFrom(lookupIn(c.env))
			if c.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), c.wantErr) {
					t.Fatalf("EnvFrom error = %v; want one containing %q", err, c.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("EnvFrom: %v", err)
			}
			if got != c.want {
				t.Fatalf("EnvFrom =\n %+v\nwant\n %+v", got, c.want)
			}
		})
	}
}

func TestEnvTokenFile(t *testing.T) {
	dir := t.TempDir()
	base := map[string]string{"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
	write := func(name, content string, mode os.FileMode) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil { // umask-proof
			t.Fatal(err)
		}
		return p
	}
	cases := []struct {
		name, path, want, wantErr string
	}{
		{"0600", write("ok", "tok-from-file\n", 0o600), "tok-from-file", ""},
		{"0400", write("ro", "ro-token", 0o400), "ro-token", ""},
		{"group readable", write("g", "t", 0o640), "", "mode 0640"},
		{"world readable", write("w", "t", 0o644), "", "mode 0644"},
		{"empty", write("e", " \n", 0o600), "", "is empty"},
		{"directory", dir, "", "not a regular file"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := map[string]string{"GODDP_TOKEN_FILE": c.path}
			for k, v := range base {
				m[k] = v
			}
			e, err := EnvFrom(lookupIn(m))
			if c.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), c.wantErr) || !strings.Contains(err.Error(), "GODDP_TOKEN_FILE") {
					t.Fatalf("error = %v; want one naming GODDP_TOKEN_FILE and containing %q", err, c.wantErr)
				}
				return
			}
			if err != nil || e.Token != c.want {
				t.Fatalf("Token = %q, %v; want %q", e.Token, err, c.want)
			}
		})
	}
}

func TestInitFromEnvReadsProcessEnv(t *testing.T) {
	for _, k := range []string{"SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "GODDP_STORE_ADDR", "GODDP_TOKEN", "GODDP_TOKEN_FILE",
		"LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GODDP_STORE", "TORCHELASTIC_USE_AGENT_STORE", "JOB_COMPLETION_INDEX"} {
		t.Setenv(k, "")
		os.Unsetenv(k)
	}
	t.Setenv("RANK", "1")
	t.Setenv("WORLD_SIZE", "2")
	t.Setenv("MASTER_ADDR", "localhost")
	t.Setenv("MASTER_PORT", "29501")
	e, err := InitFromEnv()
	if err != nil {
		t.Fatal(err)
	}
	want := Env{Rank: 1, WorldSize: 2, LocalWorldSize: 1, GroupRank: 1, MasterAddr: "localhost", MasterPort: 29501, Source: "torchrun"}
	if e != want {
		t.Fatalf("InitFromEnv = %+v, want %+v", e, want)
	}
}

func TestSlurmFirstHost(t *testing.T) {
	for in, want := range map[string]string{
		"node1":                  "node1",
		"node1,node2":            "node1",
		"gpu[07-09,12]":          "gpu07",
		"gpu[12,07-09],cpu[1-2]": "gpu12",
		"a[001-004]-ib":          "a001-ib",
		"rack[3]":                "rack3",
	} {
		if got := slurmFirstHost(in); got != want {
			t.Errorf("slurmFirstHost(%q) = %q, want %q", in, got, want)
		}
	}
}
